"""Exchanges: each way a step combines gradients, its worker and driver halves together, chosen in one place (``registry``)."""
