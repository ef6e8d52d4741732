"""splitspec.shared"""
