"""Where steps live: one storage interface and its implementations (local disks, file systems in memory, object stores), their files and the names of things in a checkpoint directory."""
