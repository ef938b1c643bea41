"""Search: the Problem for one configuration, the outer search over configurations, predictions."""
