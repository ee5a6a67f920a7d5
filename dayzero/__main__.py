from dayzero.cli import main

raise SystemExit(main())
