"""What tests share beyond fixtures: images, transformers references, the test device, and the
helpers of the API, attention and family tests. Imported as `helpers.X` (pytest puts tests/ on
the path)."""
