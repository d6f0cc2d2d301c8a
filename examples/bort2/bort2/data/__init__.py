"""Data sets for the BORT2 example: MiniDigits (embedded), Digit-Five, PACS, DomainNet."""
