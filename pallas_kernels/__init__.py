"""Pallas kernels used by jaxcb. Depends only on jax; never imports jaxcb."""
