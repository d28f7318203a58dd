"""Drop-in counterparts of tdhook 0.1.3's public modules, built on tdhook_fn's core."""

__version__ = "0.1.3"  # the version of tdhook whose API this mirrors (tdhook's own tests compare it)
