"""Exact, order-independent sums of updates (fixed point) and their chunked kernels."""
