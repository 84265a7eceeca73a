"""The frontend: a prompt or chat becomes token ids and image spans; token ids become text, stop
strings and tool calls. It runs beside whichever engine client drives the core."""
