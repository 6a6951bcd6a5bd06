"""The fast paths at scale: one data-parallel replica for all, repeated blocks folded, pipeline stages of identical blocks simulated once."""
