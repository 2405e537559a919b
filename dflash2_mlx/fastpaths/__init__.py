"""CPU fast paths the models call: the drafter block's attention and RoPE from cos/sin tables."""
