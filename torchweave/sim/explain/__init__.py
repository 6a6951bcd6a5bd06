"""What a simulation tells: the result and its memory breakdown, the timeline as a trace or a chart."""
