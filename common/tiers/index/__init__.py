"""The SQLite index the disk tier and the host tier both hold: one file per store folder, shared by
every process on it, and its one capacity.

Modules, each with one job:

- `catalog`: `Catalog`, one process's connection (schema, write transactions, admission with the
  victim rule of `kvpack.policy.eviction.shares`, ready marks, touches, facts); a tier that keeps more in
  the same transactions (the host store's pages) hands it a `CatalogExtension`;
- `batch_sql`: its multi-row statements (a number per batch that does not grow with it);
- `rows`: how it names groups and objects, and what a removal hands back (`Victim`);
- `census`: what operators read and clear (``kvpack usage`` / ``kvpack clear``);
- `files`: its files in a private folder, held open while the connection is, and across a fork;
- `check`: its start-up rules, checked without touching the store (``kvpack config``).
"""
