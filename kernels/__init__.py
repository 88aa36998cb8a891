"""Kernel sources, one module per kernel, each holding its CUDA and Metal dialects.

Shipped inside the wheel as ``paged_decode.kernels`` (a package-dir mapping in
pyproject.toml). Sources are plain strings specialized through C++ templates and a small
``#define`` prelude built by the backend, never by formatting the body.
"""
