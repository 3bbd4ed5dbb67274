"""The object-store secondary tier: blocks as objects in an S3-compatible bucket, moved by
NIXL's OBJ backend."""
