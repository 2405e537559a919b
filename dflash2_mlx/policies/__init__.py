"""Policies the decoding loop asks: the block size of each cycle (the break-even controller) and whether
the server batches verify passes. They never run the loop themselves."""
