from fedppl.cli import main

raise SystemExit(main())
