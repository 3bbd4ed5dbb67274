"""Attention: backends (cache shapes, stride orders, validation) and a reference reader."""
