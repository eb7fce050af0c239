"""Operator tools beside the floors: `inspect`, the cross-node `prefetch_check`, `deploy` (and its
TOML schema `deploy_config`). They use the pool core; nothing in the library imports them."""
