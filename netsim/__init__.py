"""splitspec.netsim"""
