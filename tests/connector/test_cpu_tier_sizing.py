"""The start-up warning for a CPU tier too small to feed the disk tier."""

from minipic.connector.scheduler.cpu_tier_sizing import cpu_tier_warning

LLAMA3_8B_BLOCK = 2 << 20  # 16 tokens x 128 KiB


def test_default_tier_is_too_small_for_two_h200_steps():
    message = cpu_tier_warning(tier_bytes=2 << 30, block_bytes=LLAMA3_8B_BLOCK, block_size=16,
                               max_num_batched_tokens=16384)
    assert message is not None
    assert "16384 tokens" in message and "32768 tokens" in message
    assert "at least 4294967296 (4.0 GiB)" in message


def test_tier_of_two_steps_passes():
    assert cpu_tier_warning(tier_bytes=4 << 30, block_bytes=LLAMA3_8B_BLOCK, block_size=16,
                            max_num_batched_tokens=16384) is None
