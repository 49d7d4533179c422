"""scaled_dot_product_attention: the public op, its passes and its tolerance models.

``op`` is the public op; ``_problem`` reads the inputs, ``_first`` and
``_second`` are the float64 passes, ``_certified`` refines the undecided
elements with balls, and ``_model`` holds the tolerance models.
"""

from .op import AttentionAlgorithm, AttentionTolerance, scaled_dot_product_attention

__all__ = ["AttentionAlgorithm", "AttentionTolerance", "scaled_dot_product_attention"]
