"""`mm_engine.ray.caption_on_ray`: batch captioning on a Ray cluster (see `mm_engine.jobs.ray_caption`)."""

from mm_engine.jobs.ray_caption import RaySummary, caption_on_ray

__all__ = ["RaySummary", "caption_on_ray"]
