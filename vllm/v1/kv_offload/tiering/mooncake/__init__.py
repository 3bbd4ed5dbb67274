"""The Mooncake secondary tier (tier type ``"mooncake"``; optional ``mooncake`` extra)."""
