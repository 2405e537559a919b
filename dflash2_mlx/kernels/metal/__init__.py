"""Metal kernel sources (*.metal) for mx.fast.metal_kernel; package data only."""
