"""Several engine cores' stats as one: counts summed, pool usage averaged, each core's kept."""

from __future__ import annotations


def sum_stats(per_core: list[dict]) -> dict:
    if len(per_core) == 1:
        return {**per_core[0], "per_core": per_core}
    total: dict = {}
    for stats in per_core:
        for key, value in stats.items():
            if isinstance(value, dict):
                into = total.setdefault(key, {})
                for k, v in value.items():
                    into[k] = into.get(k, 0) + v
            elif isinstance(value, int | float):
                total[key] = total.get(key, 0) + value
    n = len(per_core)
    # A usage fraction of pools of equal size: the mean is the whole's fraction.
    total["kv_cache_usage_perc"] = {k: v / n for k, v in total.get("kv_cache_usage_perc", {}).items()}
    total["per_core"] = per_core
    return total
