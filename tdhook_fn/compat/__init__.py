"""Drop-in counterparts of tdhook 0.1.3's public modules, built on tdhook_fn's core."""
