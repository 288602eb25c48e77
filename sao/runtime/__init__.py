"""sao.runtime"""
