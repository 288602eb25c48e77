"""sao.rollout"""
