"""FleetMedic's domain: contracts, policy, the XID catalog and settings. No I/O beyond reading
the policy file, so workflows can import it inside Temporal's sandbox."""

__version__ = "0.1.0"
