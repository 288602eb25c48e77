"""sao.train"""
