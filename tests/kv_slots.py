"""The KV-cache address of a token, as the runner computes it (Sequence's token accounting):
tests that simulate the cache on the host use it to check what each step reads and writes."""


def slot_for_position(block_table: list[int], position: int, block_size: int) -> int:
    """Flat KV-cache slot of token `position` for a sequence with `block_table`."""
    return block_table[position // block_size] * block_size + position % block_size
