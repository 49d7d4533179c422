"""scaled_dot_product_attention: the public op, its passes and its tolerance models.

``op`` is the public op; ``_problem`` reads the inputs, ``_first`` is the
float64 pass, ``_second`` (longdouble) and ``_double`` (double-double balls)
the second passes, ``_certified`` refines the undecided elements with Arb
balls, and ``_model`` holds the tolerance models.
"""

from .op import AttentionAlgorithm, AttentionTolerance, scaled_dot_product_attention

__all__ = ["AttentionAlgorithm", "AttentionTolerance", "scaled_dot_product_attention"]
