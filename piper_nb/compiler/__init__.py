"""The compiler: a directive program applied to a captured model by the declared pass
pipeline (`passes`), lowered to one instruction list per device (`lower`), and checked
before anything runs (`checks`)."""
