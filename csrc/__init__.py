"""Kernel sources (CUDA and C++), shipped as package data and JIT-built by kvpack.ops."""
