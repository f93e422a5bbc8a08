"""Recipes: `schema` declares every setting with its default, `loading` reads, checks and writes them."""
