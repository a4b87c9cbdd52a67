"""Pure-PyTorch reference of every op in `ext.ops` (fp32-exact; also the CPU implementation)."""
from ext.reference.attention import mla_paged_attention, paged_attention, write_kv

__all__ = ["paged_attention", "mla_paged_attention", "write_kv"]
