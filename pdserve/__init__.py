"""pdserve"""
