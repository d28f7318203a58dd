"""A stub of torchvision holding only what zennit 0.5.1 imports (see ../README.md)."""
