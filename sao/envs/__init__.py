"""sao.envs"""
