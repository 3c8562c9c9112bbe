"""kvpack's one typed config (`schema.KVPackConfig`), its strict builder, config files and
byte sizes."""
