"""fdeplb: expert-rearrangement orchestration for MoE serving.

The rearrangement lifecycle of FastDeploy's EPLB (FREE / DOING / LOAD_SUCC / DONE), the per-rank load results and
the weight statuses are formal state machines (``transitions``) whose state lives in Redis. See DESIGN.md.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
