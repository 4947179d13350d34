from miles_sglang_plugin.cli import main

raise SystemExit(main())
