"""Kernel sources, one module per kernel, each holding its CUDA and Metal dialects.

Plain source strings specialized only through C++ templates (never by formatting the
body); ``common.py`` holds the device helpers both dialects share.
"""
