"""Peer-to-peer KV offload tier: engines exchange KV blocks directly.

``control`` moves small control messages between peers (ZeroMQ), ``session`` runs the
per-peer protocol on top of it, and ``data`` moves the block bytes themselves.
"""
