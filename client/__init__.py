"""splitspec.client"""
