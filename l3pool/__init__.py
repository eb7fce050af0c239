"""l3pool: the L3 tier (decode-node DRAM pooled over Mooncake). Built on l2core; see l3pool/README.md."""

__version__ = "0.1.0"
