"""Judging real traffic: the records a gateway tap (``kvcanary.tap``) posts to ``/api/v1/traffic``
or publishes to NATS JetStream.

``schema`` is the wire (what a record may hold, bounded); ``overlap`` the fingerprint window of
one deployment; ``checks/`` the traffic checks, one file each, in a ``REGISTRY`` the judge runs in
order; ``judge`` maps each record to its target and node, runs the checks and turns what they find
into results for the one recording path (``monitor/recording/port.py``) and rows for ``storage``;
``pipeline`` takes a gateway's records (judged once by record id, stored, recorded); ``ingest`` is
the HTTP side (taken here, or published to the stream). From JetStream: ``stream_setup`` (the
stream, its consumers, the ownership bucket), ``partitions`` (which replica consumes which
partition), ``messages`` (a message read as records), ``jetstream`` (pull, take, acknowledge).
"""
