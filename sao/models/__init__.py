"""sao.models"""
