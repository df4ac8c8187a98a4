"""How bytes are stored: the only code that touches the operating system's file API."""
