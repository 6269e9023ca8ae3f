"""See the scheduler think: the engine-event stream over HTTP (`/v1/events`), the `/dashboard` page that draws it,
and `pagedserve replay TRACE.jsonl`, which serves the same page on a recorded trace (docs/SERVING.md)."""
