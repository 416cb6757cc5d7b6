"""Services: each public function is one transaction over the domain, called by a view or the CLI."""
