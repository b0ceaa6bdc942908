"""tools/accuracy_variants.py: variant names mean what the server's recipe names mean."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import accuracy_variants  # noqa: E402

from minipic.client.prompts.recipes import RECIPES_BY_NAME  # noqa: E402


def test_recipe_names_are_the_servers():
    assert accuracy_variants.recipe_of("epic64") is RECIPES_BY_NAME["epic64"]  # 64 tokens
    assert accuracy_variants.recipe_of("epic2") is RECIPES_BY_NAME["epic2"]
    assert accuracy_variants.recipe_of("epic1") is RECIPES_BY_NAME["epic"]  # earlier screens
    assert accuracy_variants.recipe_of("layout_causal") is RECIPES_BY_NAME["block_attention"]


def test_an_unknown_recipe_is_refused_not_read_as_a_block_count():
    with pytest.raises(SystemExit, match="unknown variant 'epic3'"):
        accuracy_variants.recipe_of("epic3")
