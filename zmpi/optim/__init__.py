"""Optimizers on flat buffers and loss scaling."""
