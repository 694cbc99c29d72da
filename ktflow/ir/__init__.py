"""ktflow's IR: typed frozen nodes in an immutable, topologically ordered graph."""

from .graph import Graph, GraphBuilder, Node
from .ops import FACTS, Op, Work
from .printer import format_node, print_graph
from .types import TOKENS, Cost, Device, DType, Placement, TensorType, WeightRef
from .verify import RULES, VerifyError, verify, violations

__all__ = ["Graph", "GraphBuilder", "Node", "FACTS", "Op", "Work", "format_node", "print_graph",
           "TOKENS", "Cost", "Device", "DType", "Placement", "TensorType", "WeightRef",
           "RULES", "VerifyError", "verify", "violations"]
