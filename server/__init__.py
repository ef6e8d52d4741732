"""splitspec.server"""
